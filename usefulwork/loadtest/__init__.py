"""usefulwork.loadtest."""
