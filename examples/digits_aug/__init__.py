"""A BatchNorm CNN on the bundled digits with random augmentation that resumes exactly."""
