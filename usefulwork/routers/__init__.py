"""usefulwork.routers."""
