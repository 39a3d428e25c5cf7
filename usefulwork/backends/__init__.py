"""usefulwork.backends."""
