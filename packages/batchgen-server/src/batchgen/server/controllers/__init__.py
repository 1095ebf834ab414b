"""Route handlers, one module per resource; each delegates to BatchService."""
