"""usefulwork.caches."""
