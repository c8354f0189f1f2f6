"""The HTTP interface (extra ``[server]``): FastAPI over the same Engine."""
