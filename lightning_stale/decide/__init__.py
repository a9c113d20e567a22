"""What is decided: the per-parameter ledger, the theory's forecast for each parameter (rho-hat, period, predicted
stall), the reset policies and the remedies."""
