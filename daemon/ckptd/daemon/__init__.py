"""The node daemon: socket server, staging arena, step jobs, CLI."""
