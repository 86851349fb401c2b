"""Structured outputs: constrain generation to a regex, a JSON schema, a Lark/EBNF grammar or a list of
choices. Grammars compile through a backend (llguidance; the seam admits others such as xgrammar),
one matcher per constrained request; the engine asks for a token bitmask per sampled row and applies
it with the ``apply_token_bitmask`` op. Requests without constraints pay nothing."""
