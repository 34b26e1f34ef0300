"""The user-facing verbs: entry point, arguments as data, rendering, doctor, demo; may import every layer."""
