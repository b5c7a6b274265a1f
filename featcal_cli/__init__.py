"""The `featcal` command: a thin layer over featcal_core (single operations) and flows/ (runs)."""
