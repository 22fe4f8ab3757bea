"""Packed-sequence compute in pure torch, shared by the reference actor and the trainer."""
