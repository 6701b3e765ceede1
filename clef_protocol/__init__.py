"""The contract between clef_frontend and clef_worker.

Both processes import this package and nothing heavier: it holds the frame codec, the message
kinds, the shared command-line flags, the request limits, and the request parsing/validation
that the front runs before admission and the worker runs again before the model.
"""
