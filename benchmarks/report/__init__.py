"""One report layer for every suite: tables, spreads over seeds, targets, plots and the page
with its machine stamp, so a results page reads the same whichever suite wrote it."""
