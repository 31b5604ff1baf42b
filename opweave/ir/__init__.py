"""OpWeave's intermediate representations: the operator graph (`OpGraph`) and the blocked graph."""
