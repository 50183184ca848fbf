"""Reference models that the CLI trains and users copy as templates."""
