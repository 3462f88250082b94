"""kvevents: the write path's front end.

Engine KV-cache events (vLLM, SGLang) arrive over ZMQ as three frames (topic,
sequence number, msgpack payload).  :mod:`kvevents.wire` decodes vLLM's frames
and payloads (both its map and its older positional event encodings),
:mod:`kvevents.sglang` decodes SGLang's payloads, and both produce the
engine-neutral events of :mod:`kvevents.events` that the pool applies to the
index.  Decoders raise :class:`kvevents.wire.PayloadError` and nothing else.
"""
