"""The grammar IR and its automata: regexes -> minimal byte DFAs, grammars -> one DFA per terminal and
one small automaton per rule."""
