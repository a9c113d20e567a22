"""What is measured: the tracked parameters (units) and their sampled elements, the stall and underflow counts, the
drift shadows, and the engine that runs them around each optimizer step."""
