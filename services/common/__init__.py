"""Pieces every service shares: error codes, typed messages and their proto forms, asyncio set-up."""
