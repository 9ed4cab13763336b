"""The cluster controller (start, scale, drain pools of Ray actors) and the head process
that runs it beside the router and the gateway (`deepinfer serve`)."""
