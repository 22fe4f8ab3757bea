"""Programs written for this framework's users to read and run: the demos' agents."""
