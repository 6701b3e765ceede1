"""How a client presents an API key: `Authorization: Bearer KEY`, and the environment variable
that holds the key for the server (`clef-serve`) and for the load tool (`clef-bench`) alike."""

ENV_VAR = "CLEF_API_KEY"
