"""JSON Schema -> a Grammar (json_grammar.py and its keyword mixins json_*.py; `$ref` resolution, pruning
and numeric bounds beside them)."""
