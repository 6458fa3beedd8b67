"""The test suite (a package: helpers are imported as ``tests.<dir>.<module>``)."""
