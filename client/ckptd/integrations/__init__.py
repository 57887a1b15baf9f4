"""Drop-in adapters for the trainers ckptd's users run (each module imports its trainer lazily)."""
