"""What several test modules share: model builders, training loops and their comparisons, planning fixtures and the
tolerance of each README claim. Test modules import from here, never from one another, so that a test's result does
not depend on which other test module was imported first."""
