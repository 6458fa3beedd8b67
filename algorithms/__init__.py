"""The shelf of named algorithm combinations: one runnable YAML per combination (``offpolicy-moe presets``)."""
