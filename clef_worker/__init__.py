"""The clef-serve worker: one persistent process that owns the model and the CUDA context.

Run as `python -m clef_worker`; it talks to the front over stdin/stdout frames
(see clef_protocol) and scores every request on its main thread.
"""
