"""Custom ops that transformed graphs call: collectives (with their conjugate backward),
vocab-parallel embedding and loss, counter-based dropout, overlapped linears, copy engines."""
