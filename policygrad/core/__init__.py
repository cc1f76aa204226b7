"""The chapter's math as pure functions of torch tensors.

Nothing in ``policygrad.core`` imports from the rest of the package, loads a model, reads a file
or takes a config object. Shapes follow one glossary: B sequences, T response tokens
(right-padded), G samples per prompt, V vocabulary.
"""
