"""usefulwork.gateway."""
