"""A Buzz-shaped fleet (issue 24 item 4): tests/fleet/buzz_agent.py and the test that runs it."""
