"""The API's routes, one module per group; worker.api.app includes every router."""
