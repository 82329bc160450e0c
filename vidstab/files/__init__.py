"""Trusted files: what is written atomically (temp + fsync + rename), the one strict-JSON convention, state dicts as
safetensors + JSON, and the bounds on what a file may ask for."""
