"""Runs that survive kills and preemption: atomic checkpoint writes, save-and-exit on
SIGTERM/SIGINT, a stop on non-finite losses, and checks that refuse bad input before training.
See docs/reliability.md."""
