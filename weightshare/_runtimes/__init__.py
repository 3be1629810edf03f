"""Running models in their real runtimes and measuring memory (optional dependencies)."""
