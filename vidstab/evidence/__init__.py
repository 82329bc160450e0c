"""Evidence of a bad step: incident bundles (write and read), the non-finite module's localisation, what a replay needs
without user code (the model's record, its PEFT adapters) and sample ids."""
