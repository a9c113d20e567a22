"""What is done to the optimizer state, in place: resets and their listeners, warm-up, the remedy's actions
(interventions) and the v-underflow guard."""
