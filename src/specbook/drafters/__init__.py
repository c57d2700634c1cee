"""One module per method; each defines a Drafter (decoding.Drafter protocol)."""
