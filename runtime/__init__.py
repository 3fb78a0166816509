"""Process settings every skillpool process shares: the base model it serves or trains, the dtype it computes in,
and how it runs torch's CPU threads (OpenMP)."""
