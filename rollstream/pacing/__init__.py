"""Producer pacing: budget, leases and consumed bitmaps (budget), and leases taken back (expiry)."""
