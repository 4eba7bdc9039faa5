"""The web stack (``server``: Starlette on uvicorn with the server's limits, :mod:`hf_unlearn.webserver` at the ground) and the deletion-request intake
(``intake``: ``hf-unlearn requests web``). Starlette and uvicorn are core dependencies (the quickstart's local Hub runs on them)."""
