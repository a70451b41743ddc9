"""Request and response shapes of the API groups whose routes module would be too long with them."""
