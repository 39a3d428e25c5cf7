"""usefulwork.backends.sim."""
