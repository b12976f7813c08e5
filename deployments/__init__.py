"""Ray Serve shell over the pure core in `app/`: ingress, engine replicas, router, tuning controller."""
