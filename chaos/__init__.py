"""Chaos runs: fault injection, token-fate accounting and the post-run audit (DESIGN §5)."""
