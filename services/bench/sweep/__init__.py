"""`deepinfer bench sweep`: several `deepinfer serve` configurations, each over a range of request
rates, and the goodput of each: the highest rate at which enough requests meet both latency SLOs."""
