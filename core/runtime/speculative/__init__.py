"""Speculative decoding: proposers guess a request's next tokens, the target model verifies the guess
in one extend step, and the tokens it agrees with are kept (docs/speculative.md).

  proposer.py    Proposer: what every proposer does (draft tokens for a batch of requests)
  ngram.py       NgramProposer: prompt lookup over the request's own tokens
  draft_model.py DraftModelProposer: a smaller checkpoint with its own KV pool, drafting greedily
  eagle.py       EagleProposer: an EAGLE head over the target's hidden states, drafting chains
  eagle_tree.py  EagleTreeProposer: EAGLE-2's draft trees (speculative_eagle_topk > 1)
  tree.py        DraftTree: a draft of several continuations (a chain is one), the kept path, tries
  state.py       SpecState: a request's rate of kept draft tokens, and its counters
  policy.py      DraftPolicy: each step's draft lengths, from acceptance rates and measured step times
  verify.py      the verify step's model input, the requests at each verify row, the grammar's masks
  speculator.py  Speculator: the scheduler's unit that runs verify steps instead of decode steps
  build.py       build_speculator: the speculator the engine options ask for

Drafts are deterministic (the proposer's greedy guess), so rejection sampling with a one-hot draft
distribution q reduces to: sample the target's token x from p at the draft position and accept the
draft token d iff x == d (P = p(d) = min(1, p(d) / q(d))); a rejected position keeps x, which is then
distributed as the residual max(p - q, 0), normalised. Each kept token is therefore distributed as
without speculation, and greedy outputs are the same tokens. A tree applies the rule child after child
(tree.py).
"""
