"""Scale-out: tensor-parallel ranks and the data-parallel router."""
