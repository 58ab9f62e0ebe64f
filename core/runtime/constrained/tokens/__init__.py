"""The vocabulary side: what each token writes, which tokens each terminal DFA state allows, and masks
over a batch of logits."""
