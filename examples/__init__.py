"""Example tasks that plug into the pipeline through config factories (see the README, section "Your own model")."""
