"""How tokens are proposed and verified: draft sets, affinity substitution, acceptance."""
