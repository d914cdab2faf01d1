"""Test support: databases, clusters, factories and waiting helpers shared by the suite."""
