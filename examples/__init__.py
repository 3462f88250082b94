"""Runnable examples and simulated peers that use kvindex; nothing in the library imports them."""
