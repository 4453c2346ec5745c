"""Sessions as records: keys, transcripts, turns, the journal and the store. No torch here."""
